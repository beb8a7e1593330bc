"""The build's ``manifest.json`` (totals, layout, checksums) and the atomic publish of the staging folder."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa

from meta_io import layout as L
from meta_io.build.config import MetaIOBuildConfig
from meta_io.build.packers import _BucketPacker
from meta_io.build.pass1 import _Spill
from meta_io.build.pass2 import _Stats
from meta_io.index import IndexBuilder
from meta_io.integrity import MANIFEST_VALUE as CHECKSUMS_MANIFEST
from meta_io.layout import BatchKind, Layout
from meta_io.schema import Schema
from common.atomic_write import write_json_atomic
from common.config import to_dict


def dataset_files(folder: Path) -> list[Path]:
    """Files of a Meta-IO dataset present in ``folder`` (manifest, index, parts, leftovers)."""
    out = [folder / L.MANIFEST_NAME, folder / L.INDEX_NAME]
    out += sorted(folder.glob("part-*.arrow")) + sorted(folder.glob("leftover-*.arrow"))
    return [p for p in out if p.exists()]


def _first_missing(path: Path) -> Path | None:
    """The outermost ancestor-or-self of ``path`` that does not exist (None: it exists)."""
    missing = None
    p = path.absolute()
    while not p.exists():
        missing, p = p, p.parent
    return missing


def _index_checksum(path: Path) -> dict[str, Any]:
    """Manifest keys that protect ``index.arrow`` and announce the per-batch checksums."""
    return {"checksums": CHECKSUMS_MANIFEST, "index_bytes": path.stat().st_size,
            "index_crc32": zlib.crc32(path.read_bytes()) & 0xFFFFFFFF}


def _manifest(
    cfg: MetaIOBuildConfig,
    schema: Schema,
    key: str,
    data_schema: pa.Schema,
    input_path: Path,
    spill: _Spill,
    stats: _Stats,
    packers: list[_BucketPacker],
    files: list[dict[str, Any]],
    left_files: list[dict[str, Any]],
    index: IndexBuilder,
    seconds: float,
    pass2_s: float,
) -> dict[str, Any]:
    meta_entries = [e for e in index.entries if e.kind == BatchKind.META]
    slots = sum(e.n_slots for e in meta_entries)
    meta_rows = stats.support_rows + stats.query_rows
    buckets = []
    for pk in packers:
        b = pk.bucket
        buckets.append(dict(level=b.level, capacity=b.capacity, support=b.support, query=b.query,
                            tasks_per_batch=pk.T, slots_per_batch=pk.T * pk.c, batches=pk.batches,
                            episodes=pk.episodes, rows=pk.rows))
    totals: dict[str, Any] = dict(
        input_rows=spill.input_rows,
        support_rows=stats.support_rows,
        query_rows=stats.query_rows,
        leftover_rows=stats.leftover_rows,
        plain_rows=stats.plain_rows,
        tasks=stats.tasks,
        leftover_tasks=stats.leftover_tasks,
        missing_key_rows=stats.missing_key_rows,
        episodes=stats.episodes,
        batches=len(index.entries),
        meta_batches=len(meta_entries),
        files=len(files),
        leftover_files=len(left_files),
        bytes=sum(f["bytes"] + f["ids_bytes"] for f in files + left_files),
        build_seconds=round(seconds, 3),
        pass1_seconds=round(spill.seconds, 3),
        pass2_seconds=round(pass2_s, 3),
        rows_per_s=int(spill.input_rows / max(seconds, 1e-9)),
        partitions=len(spill.paths),
    )
    if cfg.layout == Layout.META:
        width = cfg.support + cfg.query
        t0 = max(1, cfg.rows_per_batch // width)
        unbucketed_slots = -(-stats.episodes // t0) * t0 * width
        totals["slots"] = slots
        totals["fill_ratio"] = round(meta_rows / slots, 4) if slots else 0.0
        totals["fill_ratio_without_buckets"] = round(meta_rows / unbucketed_slots, 4) if unbucketed_slots else 0.0
        # the same, ignoring the empty task slots of each bucket's last batch
        ep_slots = sum(pk.episodes * pk.c for pk in packers)
        totals["episode_fill_ratio"] = round(meta_rows / ep_slots, 4) if ep_slots else 0.0
        totals["episode_fill_ratio_without_buckets"] = (
            round(meta_rows / (stats.episodes * width), 4) if stats.episodes else 0.0
        )
    else:
        plain_slots = sum(e.n_slots for e in index.entries)
        totals["slots"] = plain_slots
        totals["fill_ratio"] = round(stats.plain_rows / plain_slots, 4) if plain_slots else 0.0
    return {
        "format": "metaio",
        "format_version": L.FORMAT_VERSION,
        "layout": cfg.layout.value,
        "support": cfg.support,
        "query": cfg.query,
        "split": cfg.split.value,
        "seed": cfg.seed,
        "task_key": key,
        "rows_per_batch": cfg.rows_per_batch,
        "bucketing": cfg.bucketing,
        "config": to_dict(cfg),
        "input": str(input_path),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "schema": schema.to_dict(),
        "columns": data_schema.names,
        "buckets": buckets,
        "files": files,
        "leftover_files": left_files,
        "totals": totals,
        "scenario_rows": dict(sorted(stats.scenario.items(), key=lambda kv_: _num_key(kv_[0]))),
    }


def _num_key(s: str) -> tuple[int, float | str]:
    try:
        return (0, float(s))
    except ValueError:
        return (1, s)


def _publish(staging: Path, out: Path, files: list[dict[str, Any]], manifest: dict[str, Any], overwrite: bool) -> None:
    """Move the staged dataset into ``out``; the manifest goes last, atomically.

    An old dataset (``overwrite``) loses its manifest first, so a crash in the
    middle leaves a folder that never looks complete.
    """
    if overwrite:
        old_manifest = out / L.MANIFEST_NAME
        if old_manifest.exists():
            old_manifest.unlink()
        for p in dataset_files(out):
            p.unlink()
    for f in files:
        os.replace(staging / f["name"], out / f["name"])
        os.replace(staging / f["ids"], out / f["ids"])
    os.replace(staging / L.INDEX_NAME, out / L.INDEX_NAME)
    write_json_atomic(out / L.MANIFEST_NAME, manifest, indent=2)
