"""Training checkpoint -> delivery bundle (full or incremental).

Reading the checkpoint goes through :class:`CheckpointSource` (the only code
here that knows ``ps.checkpoint``). Per table, its rows are concatenated across
shards, sorted by id once, and written with bulk ``putmulti`` in id order::

    checkpoint (N shards)            bundle staging dir
    table user: shard0 rows ----+
                shard1 rows ----+--> sort by id --> embeddings.lmdb  (user\\0<id>)
    dense params (PS dense) --> build_model + load --> trace --> dense.pt
    manifest info (schema, model, step, data range, metrics) --> manifest.json

An incremental export against a parent bundle writes only the rows whose id is
new or whose stored bytes differ from the parent's (64-bit fingerprints from the
chain's ``index.arrow``, compared with one ``searchsorted``), and the ids the
parent served that are gone now (``np.setdiff1d`` on sorted ids) into
``removed.arrow``. (The PS ``last_step`` is a per-shard, per-table counter that
migration carries between shards, so it cannot safely select changed rows.)

When the checkpoint is a delta whose chain passes through the parent bundle's
checkpoint (same ``ckpt_id``), only the delta checkpoints after it are read
(:meth:`CheckpointSource.changes`): their changed rows (the PS's dirty rows) and
removed ids, combined newest-wins; only those rows are fingerprinted against
the parent. Nothing else of the checkpoint is read, verified or decoded, so the
cost follows the changed fraction. Any other case reads every row as above.

A long-lived process (the periodic job) passes an :class:`~delivery.reuse.ExportCache`:
parsed configs, the built model, the parent's traced dense network and live ids are
then reused, each keyed by the content it stands for; every check runs as without it.

Progress: ``export_bundle(..., progress=hook)`` calls ``hook(DeliverStage.EXPORT, done,
total)`` (no printing here; ``metaps deliver`` draws a bar or logs lines): rows of the
tables exported so far out of the rows to export, told once before the first table and
after each table (read, compared with the parent, written). The total is known before
any row is read: the checkpoint manifest's rows per table for a full read, the changed
rows of the delta checkpoints for a changes-only read (0: unknown, a manifest without row
counts). ``done`` never goes down; the last call, once the embedding file is closed, is
``done == total``. Then ``DeliverStage.DENSE`` (one step: dense network, adaptation
parameters, checksums, manifest). The other stages of a delivery are told by
:mod:`delivery.job`.

Example::

    src = CheckpointSource.open(latest_checkpoint(run / "checkpoints"))
    manifest = export_bundle(src, staging, "v000001", DeliveryConfig(out=root))
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from delivery.bundle import (
    DENSE, EMBEDDINGS, INDEX, REMOVED, BundleKind, BundleManifest, DeliveryError, EmbeddingWriter, TableInfo,
    checksum_files, read_index, read_removed, row_fingerprints, table_prefix, write_manifest, write_removed,
)
from delivery.config import DeliveryConfig
from delivery.dense import DenseSpec, save_scripted, trace_dense
from delivery.reuse import ExportCache, Live, LiveKey, advance_live, canonical, locate
from meta_io.schema import Schema, schema_from_dict
from common.config import from_mapping
from common.errors import ConfigError, MetapsError
from common.eta import ProgressHook as ProgressHook  # re-exported: deliver_once(progress=...)
from common.log import kv

if TYPE_CHECKING:
    from models.base import CtrModel

log = logging.getLogger(__name__)

REQUIRED_INFO = ("schema", "model")


class DeliverStage(enum.StrEnum):
    """The stages a delivery reports progress for, in order (values: one word, for bars and log fields).

    ``EXPORT`` counts rows; the others are one step each (``done`` 0 then 1 of ``total`` 1):
    ``DENSE`` is the rest of the bundle (dense network, adaptation parameters, checksums, manifest).
    """

    VERIFY = "verify"
    EXPORT = "export"
    DENSE = "dense"
    GATE = "gate"
    PUBLISH = "publish"


@dataclass
class TableData:
    """All rows of one table of a checkpoint.

    ``ids`` and ``last_step`` are sorted by id; ``raw_weights`` stay in read order and
    ``order`` sorts them, so a delta gathers only its changed rows.
    """

    ids: np.ndarray
    raw_weights: np.ndarray
    order: np.ndarray
    last_step: np.ndarray

    def weights(self, sel: np.ndarray | None = None) -> np.ndarray:
        """Rows in id order (all, or those at sorted positions ``sel``)."""
        return self.raw_weights[self.order if sel is None else self.order[sel]]


class CheckpointSource:
    """A committed training checkpoint, read for export.

    Args:
        path: the checkpoint directory (``.../checkpoints/ckpt-<step>``).
        manifest: its parsed manifest (``ps.checkpoint.read_manifest``).
        cache: a long-lived process's :class:`~delivery.reuse.ExportCache` (the schema and
            model config are parsed once per distinct text); None = parse here.

    Raises (from :meth:`open`):
        DeliveryError: missing checkpoint, unreadable manifest, or no schema/model info.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], cache: ExportCache | None = None) -> None:
        self.path = path
        self.manifest = manifest
        info = manifest.get("info", manifest)
        missing = [k for k in REQUIRED_INFO if k not in info]
        if missing:
            raise DeliveryError(
                f"{path}: checkpoint manifest has no {missing} info; the trainer must checkpoint with "
                f"info={{'schema': ..., 'model': ..., 'step': ...}} to make it deliverable"
            )
        self.info = info
        self.config_key = canonical([info["schema"], info["model"]])
        """The schema + model config text: equal keys, equal parsed configs and models."""

        def parse() -> tuple[Schema, Any]:
            schema = schema_from_dict(info["schema"], where=f"{path}: manifest info.schema")
            from models.config import ModelConfig

            try:
                return schema, from_mapping(ModelConfig, info["model"], where=f"{path}: manifest info.model")
            except ConfigError as exc:
                raise DeliveryError(str(exc)) from None

        parsed = cache.configs(self.config_key, parse) if cache is not None else parse()
        self.schema: Schema = parsed[0]
        self.model_cfg = parsed[1]
        self.step = int(info.get("step", manifest.get("step", -1)))
        self.table_dims = _manifest_tables(path, manifest)

    @classmethod
    def open(cls, path: str | Path, verify: bool = True, cache: ExportCache | None = None) -> "CheckpointSource":
        """Open (and by default sha256-verify) a committed checkpoint (``cache``: see the class)."""
        p = Path(path)
        if not p.is_dir():
            raise DeliveryError(f"{p}: checkpoint directory not found")
        from ps.checkpoint import read_manifest, verify_checkpoint

        try:
            manifest = verify_checkpoint(p) if verify else read_manifest(p)
        except MetapsError as exc:
            raise DeliveryError(f"{p}: not a committed checkpoint: {exc}") from None
        except (OSError, ValueError) as exc:
            raise DeliveryError(f"{p}: cannot read the checkpoint manifest: {exc}") from None
        return cls(p, manifest, cache)

    def table(self, table: str) -> TableData:
        """Every row of ``table`` across shards, sorted by id (one argsort, no per-row Python)."""
        if table not in self.table_dims:
            raise DeliveryError(f"{self.path}: checkpoint has no table '{table}'; it has {sorted(self.table_dims)}")
        from ps.checkpoint import read_rows

        dim = self.table_dims[table]
        try:
            parts = list(read_rows(self.path, table))
        except MetapsError as exc:
            raise DeliveryError(f"{self.path}: cannot read table '{table}': {exc}") from None
        if parts:
            ids = np.concatenate([np.asarray(p.ids, np.int64) for p in parts])
            w = np.concatenate([np.asarray(p.weights, np.float32).reshape(-1, dim) for p in parts])
            ls = np.concatenate([np.asarray(p.last_step, np.int64) for p in parts])
        else:
            ids, w, ls = np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros(0, np.int64)
        order = np.argsort(ids, kind="stable")
        ids, ls = ids[order], ls[order]
        dup = np.flatnonzero(ids[1:] == ids[:-1])
        if dup.size:
            raise DeliveryError(
                f"{self.path}: table '{table}': id {int(ids[dup[0] + 1])} is stored by more than one shard"
            )
        return TableData(ids, w, order, ls)

    def deltas_after(self, parent: "ParentState") -> list[Path] | None:
        """The delta checkpoints between the parent bundle's checkpoint and this one (oldest first).

        None when this checkpoint's chain does not pass through the parent's
        checkpoint (matched by ``ckpt_id``; then every row must be read). An
        empty list: the same checkpoint. The returned deltas are sha256-verified
        (this checkpoint was verified by :meth:`open`).
        """
        if not parent.ckpt_id:
            return None
        from ps.checkpoint import checkpoint_chain, verify_checkpoint

        try:
            chain = checkpoint_chain(self.path)
        except MetapsError as exc:
            raise DeliveryError(f"{self.path}: cannot resolve its checkpoint chain: {exc}") from None
        ids = [m.get("ckpt_id") for _d, m in chain]
        if parent.ckpt_id not in ids:
            return None
        after = [d for d, _m in chain[ids.index(parent.ckpt_id) + 1 :]]
        try:
            for d in after[:-1]:
                verify_checkpoint(d)
        except MetapsError as exc:
            raise DeliveryError(f"{d}: delta checkpoint failed verification: {exc}") from None
        return after

    def changes(self, table: str, deltas: list[Path]) -> tuple[TableData, np.ndarray]:
        """Rows of ``table`` changed over ``deltas`` (newest value wins) and the ids removed since.

        Reads only the delta files (``ps.checkpoint.read_changes``); sorted-set numpy
        ops, no per-row Python. Returns (changed rows sorted by id, removed ids sorted).
        """
        return self.changes_many([table], deltas)[table]

    def changes_many(self, tables: list[str], deltas: list[Path]) -> dict[str, tuple[TableData, np.ndarray]]:
        """:meth:`changes` of several tables, each delta's shard files read in one pass."""
        for table in tables:
            if table not in self.table_dims:
                raise DeliveryError(f"{self.path}: checkpoint has no table '{table}'; it has {sorted(self.table_dims)}")
        from ps.checkpoint import read_changes_tables

        read: list[dict[str, Any]] = []
        for d in deltas:
            try:
                read.append(read_changes_tables(d, tables))
            except MetapsError as exc:
                raise DeliveryError(f"{d}: cannot read the changes of tables {tables}: {exc}") from None
        return {t: self._combine(t, [r[t] for r in read]) for t in tables}

    def _combine(self, table: str, per_delta: list[tuple[Any, np.ndarray]]) -> tuple[TableData, np.ndarray]:
        """Changed rows and removed ids of consecutive deltas (oldest first), newest value winning."""
        from ps.checkpoint import in_sorted

        dim = self.table_dims[table]
        ids = np.zeros(0, np.int64)
        w = np.zeros((0, dim), np.float32)
        ls = np.zeros(0, np.int64)
        gone = np.zeros(0, np.int64)
        for rows, removed in per_delta:
            r_ids = np.asarray(rows.ids, np.int64)
            r_sorted = np.sort(r_ids)
            if ids.size:  # (sort + searchsorted: numpy 2's hash-based isin/unique are far slower here)
                keep = ~(in_sorted(ids, r_sorted) | in_sorted(ids, removed))
                ids = np.concatenate([ids[keep], r_ids])
                w = np.concatenate([w[keep], np.asarray(rows.weights, np.float32).reshape(-1, dim)])
                ls = np.concatenate([ls[keep], np.asarray(rows.last_step, np.int64)])
            else:
                ids, ls = r_ids, np.asarray(rows.last_step, np.int64)
                w = np.asarray(rows.weights, np.float32).reshape(-1, dim)
            gone = np.sort(np.concatenate([gone[~in_sorted(gone, removed)], removed]))  # both sorted, unique
            gone = gone[~in_sorted(gone, r_sorted)]
        order = np.argsort(ids, kind="stable")
        s_ids = ids[order]
        dup = np.flatnonzero(s_ids[1:] == s_ids[:-1])
        if dup.size:
            raise DeliveryError(f"{self.path}: table '{table}': id {int(s_ids[dup[0] + 1])} is stored by more "
                                f"than one shard of a delta checkpoint")
        return TableData(s_ids, w, order, ls[order]), gone

    def dense(self, names: list[str]) -> dict[str, np.ndarray]:
        """Dense parameter values by name (the model's ``named_parameters()`` names).

        Read straight from the ``d/<name>`` chunks of the shard files (values only;
        no optimizer objects are built, which keeps delivery light).
        """
        import lmdb

        from ps.checkpoint import open_shard_file, shard_files, unpack_arrays

        values: dict[str, np.ndarray] = {}
        for path in shard_files(self.path):
            try:  # (refuses a truncated file: reading past its end would be SIGBUS)
                env = open_shard_file(path)
            except MetapsError as exc:
                raise DeliveryError(f"{self.path}: cannot read dense parameters: {exc}") from None
            try:
                with env.begin(buffers=False) as txn:
                    for name in names:
                        try:
                            raw = txn.get(f"d/{name}".encode())
                        except lmdb.Error as exc:
                            raise DeliveryError(f"{path} key 'd/{name}': LMDB error {type(exc).__name__}: {exc} "
                                                f"(corrupt shard file)") from None
                        if raw is None or name in values:
                            continue
                        try:
                            arrays = unpack_arrays(raw, f"{path} key 'd/{name}'")
                        except MetapsError as exc:
                            raise DeliveryError(f"{self.path}: cannot read dense parameters: {exc}") from None
                        if "value" not in arrays:
                            raise DeliveryError(f"{path}: dense chunk 'd/{name}' lacks 'value'")
                        values[name] = arrays["value"]
            finally:
                env.close()
        missing = [n for n in names if n not in values]
        if missing:
            raise DeliveryError(
                f"{self.path}: checkpoint lacks dense parameters {missing[:5]}{'...' if len(missing) > 5 else ''} "
                f"({len(missing)} of {len(names)}); was it trained with dense_sync = 'ps'?"
            )
        return values


def _told(progress: ProgressHook | None, done: int, total: int) -> None:
    """Tell ``progress`` the export's rows so far (a total of 0 stays unknown; a low one grows to ``done``)."""
    if progress is not None:
        progress(DeliverStage.EXPORT, done, max(total, done) if total else 0)


def _manifest_rows(manifest: dict[str, Any], tables: list[str]) -> int:
    """Rows of ``tables`` per the checkpoint manifest (0 for a table it gives no count for)."""
    entries = manifest.get("tables")
    if isinstance(entries, list):
        entries = {str(t.get("name")): t for t in entries if isinstance(t, dict)}
    if not isinstance(entries, dict):
        return 0
    rows = [entries.get(t, {}).get("rows") if isinstance(entries.get(t), dict) else None for t in tables]
    return sum(int(r) for r in rows if isinstance(r, int) and not isinstance(r, bool))


def _manifest_tables(path: Path, manifest: dict[str, Any]) -> dict[str, int]:
    tables = manifest.get("tables")
    if isinstance(tables, dict):
        out = {}
        for name, v in tables.items():
            out[name] = int(v["dim"] if isinstance(v, dict) else v)
        return out
    if isinstance(tables, list):
        return {str(t["name"]): int(t["dim"]) for t in tables}
    raise DeliveryError(f"{path}: checkpoint manifest has no 'tables' with dims")


def resolve_checkpoint(run: str | Path | None = None, checkpoint: str | Path | None = None) -> Path:
    """The checkpoint to deliver: ``checkpoint`` itself, or the latest one of run ``run``.

    Raises:
        DeliveryError: nothing given, the run has no checkpoints, the path is missing.
    """
    if checkpoint is not None:
        p = Path(checkpoint)
        if not p.is_dir():
            raise DeliveryError(f"{p}: checkpoint directory not found")
        return p
    if run is None:
        raise DeliveryError("give a run directory (--run) or a checkpoint directory (--checkpoint)")
    root = Path(run)
    if not root.is_dir():
        raise DeliveryError(f"{root}: run directory not found")
    from ps.checkpoint import latest_checkpoint

    ckroot = root / "checkpoints"
    latest = latest_checkpoint(ckroot) if ckroot.is_dir() else None
    if latest is None:
        raise DeliveryError(f"{root}: run has no committed checkpoint under {ckroot}")
    return Path(latest)


def warm_start_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint a continued training run should start from (``metaps launch --resume-from``).

    Accepts a run directory, its ``checkpoints`` folder, or a checkpoint itself;
    checks that the checkpoint carries the schema and model info.

    Example::

        ckpt = warm_start_checkpoint("runs/yesterday")   # runs/yesterday/checkpoints/ckpt-9000
    """
    p = Path(run_dir)
    if (p / "checkpoints").is_dir() or not p.exists():
        ckpt = resolve_checkpoint(run=p)
    else:
        from ps.checkpoint import latest_checkpoint

        try:
            CheckpointSource.open(p)
            ckpt = p
        except DeliveryError:
            latest = latest_checkpoint(p)
            if latest is None:
                raise DeliveryError(f"{p}: neither a run, a checkpoints folder, nor a committed checkpoint") from None
            ckpt = Path(latest)
    CheckpointSource.open(ckpt)
    return ckpt


# -- parent state ---------------------------------------------------------------------
@dataclass
class ParentState:
    """What an incremental export needs from the published parent version.

    Args:
        live: table -> (sorted ids, row fingerprints) served at the parent version.
    """

    version: str
    base: str
    watermark: int
    live: dict[str, tuple[np.ndarray, np.ndarray]]
    dims: dict[str, int]
    dtype: str
    chain_length: int
    ckpt_id: str | None = None
    """``ckpt_id`` of the checkpoint the parent was exported from (delta checkpoints after it hold the changes)."""
    path: Path | None = None
    """The parent bundle's directory (its traced ``dense.pt`` is reused when schema and model match)."""
    schema: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    dense_spec: dict[str, Any] | None = None
    dense_sha: str | None = None
    """sha256 of the parent's ``dense.pt`` per its manifest (the key of a cached traced network)."""
    live_key: LiveKey = ()
    """(version, index sha, removed sha) per bundle of the chain: the key of ``live`` in an ExportCache."""
    spent: str | None = None
    """The version whose export advanced ``live`` in place (taken from the cache): no longer the parent's."""


def live_key(chain: list[tuple[Path, BundleManifest]]) -> LiveKey:
    """The content key of a chain's live ids: each bundle's version and index/removed sha256 (newest first)."""
    return tuple((m.version, m.files.get(INDEX, ""), m.files.get(REMOVED, "")) for _d, m in chain)


def parent_state(chain: list[tuple[Path, BundleManifest]], cache: ExportCache | None = None) -> ParentState:
    """Live ids and fingerprints per table at the newest bundle of ``chain`` (newest first).

    Starts from the base's ``index.arrow``; each delta drops its removed ids and
    overrides/adds its written rows (sorted-set numpy ops, no per-row Python).
    With ``cache``, the live ids of a chain whose every index/removed sha256 (per
    the manifests) was seen before are reused instead of read.
    """
    newest = chain[0][1]
    key = live_key(chain)
    cached = cache.live(key) if cache is not None else None
    live = cached if cached is not None else read_live(chain)
    if cache is not None and cached is None:
        cache.put_live(key, live)
    return ParentState(
        version=newest.version, base=newest.base or newest.version, watermark=newest.row_watermark,
        live=live, dims={t: i.dim for t, i in newest.tables.items()}, dtype=newest.dtype.value,
        chain_length=len(chain) - 1, ckpt_id=newest.source.get("ckpt_id"), path=chain[0][0],
        schema=newest.schema, model=newest.model, dense_spec=newest.dense, dense_sha=newest.files.get(DENSE),
        live_key=key,
    )


def read_live(chain: list[tuple[Path, BundleManifest]]) -> Live:
    """Live ids and fingerprints at the newest bundle of ``chain`` (newest first), read from its files."""
    live = read_index(chain[-1][0] / INDEX)
    for d, _m in reversed(chain[:-1]):
        rem = read_removed(d / REMOVED)
        for t, (w_ids, w_fp) in read_index(d / INDEX).items():
            ids, fp = live.get(t, (np.zeros(0, np.int64), np.zeros(0, np.uint64)))
            keep = ~np.isin(ids, w_ids, assume_unique=True)
            ids = np.concatenate([ids[keep], w_ids])
            fp = np.concatenate([fp[keep], w_fp])
            order = np.argsort(ids, kind="stable")
            live[t] = (ids[order], fp[order])
        for t, gone in rem.items():
            ids, fp = live.get(t, (np.zeros(0, np.int64), np.zeros(0, np.uint64)))
            keep = ~np.isin(ids, gone, assume_unique=True)
            live[t] = (ids[keep], fp[keep])
    return live


def changed_since(parent_ids: np.ndarray, parent_fp: np.ndarray, ids: np.ndarray, fp: np.ndarray,
                  located: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """bool per current row: new id, or stored bytes differ from the parent's (all inputs sorted by id).

    Args:
        located: ``reuse.locate(parent_ids, ids)`` when the caller has it already; else searched here.
    """
    pos, known = located if located is not None else locate(parent_ids, ids)
    if parent_ids.size == 0:
        return ~known
    return ~known | (parent_fp[pos.clip(max=parent_ids.size - 1)] != fp)


# -- export ---------------------------------------------------------------------------
def build_trained_model(src: CheckpointSource, cache: ExportCache | None = None) -> tuple[CtrModel, dict[str, int]]:
    """The checkpoint's model with its trained dense parameters loaded.

    Args:
        src: the checkpoint.
        cache: reuse the model built for the same schema + model config text (every
            parameter is loaded from ``src`` all the same; buffers reset to their built values).
    """
    from models.factory import build_model

    if cache is not None:
        model = cache.model(src.config_key, lambda: build_model(src.schema, src.model_cfg))
    else:
        model = build_model(src.schema, src.model_cfg)
    dims = dict(model.dims)
    for t, dim in dims.items():
        if t not in src.table_dims:
            raise DeliveryError(f"{src.path}: checkpoint has no table '{t}' (model tables: {sorted(dims)})")
        if src.table_dims[t] != dim:
            raise DeliveryError(f"{src.path}: table '{t}': model expects dim {dim}, checkpoint has dim {src.table_dims[t]}")
    names = [n for n, _ in model.named_parameters()]
    values = src.dense(names)
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = np.asarray(values[name], dtype=np.float32)
            if v.size != p.numel():
                raise DeliveryError(
                    f"{src.path}: dense parameter '{name}': expected {tuple(p.shape)} ({p.numel()} values), got {v.shape}"
                )
            p.copy_(torch.from_numpy(v.reshape(p.shape)))
    return model.eval(), dims


def _reuse_parent_dense(
    model: torch.nn.Module, src: CheckpointSource, dims: dict[str, int], parent: ParentState | None,
    cache: ExportCache | None = None,
) -> tuple[torch.jit.ScriptModule, DenseSpec] | None:
    """The parent bundle's traced dense network with this checkpoint's parameters, or None.

    Tracing is the largest fixed cost of a bundle (~0.3 s here); a delta's model has
    the parent's graph whenever schema and model config are unchanged, so the
    parent's ``dense.pt`` is loaded, given the new parameters and buffers, and
    checked against eager ``model.predict`` on an example batch (as
    :func:`~delivery.dense.trace_dense` checks a fresh trace). Any mismatch: None
    (trace afresh).

    Args:
        model: the checkpoint's model, trained parameters loaded.
        src: the checkpoint.
        dims: table -> dim.
        parent: the parent state (None: nothing to reuse).
        cache: a process's cache: the parent's traced module is taken from it when one
            equal to the parent's ``dense.pt`` (same sha256 as the parent's manifest records)
            is there, instead of loading the file; it gets this checkpoint's state and the
            same check all the same.
    """
    if parent is None or parent.path is None or parent.dense_spec is None:
        return None
    if parent.schema != src.schema.to_dict() or parent.model != dict(src.info["model"]):
        return None
    from delivery.dense import example_inputs, flat_inputs, input_names, load_scripted

    spec = DenseSpec(inputs=list(parent.dense_spec["inputs"]), heads=list(parent.dense_spec["heads"]),
                     tables=list(parent.dense_spec["tables"]))
    if spec.inputs != input_names(src.schema, list(getattr(model, "tables", src.schema.tables))):
        return None
    try:
        scripted = cache.take_dense(parent.dense_sha) if cache is not None else None
        if scripted is None:
            scripted = load_scripted(str(parent.path / DENSE))
        scripted.load_state_dict({f"model.{k}": v for k, v in model.state_dict().items()}, strict=True)
    except (DeliveryError, RuntimeError, KeyError) as exc:
        log.info("parent dense network not reusable; tracing", extra=kv(parent=parent.version, error=str(exc)[:200]))
        return None
    def make() -> Any:
        return example_inputs(src.schema, dims, rows=37, id_space=400, seed=2)

    example = cache.example((src.config_key, tuple(sorted(dims.items()))), make) if cache is not None else make()
    fb, uniq, rows = example
    with torch.no_grad():
        predict: Callable[..., dict[str, torch.Tensor]] = getattr(model, "predict")
        want = predict(fb, rows, uniq)
        # The graph as recorded, without the profiling executor's specializing pass (which a
        # reused module would otherwise run on its second call, ~20 ms here): same graph, same check.
        with torch.jit.optimized_execution(False):
            got = scripted(*flat_inputs(spec.inputs, fb, uniq, rows))
    for h, g in zip(spec.heads, got):
        if h not in want or g.shape != want[h].shape or not torch.allclose(g, want[h], atol=1e-5, rtol=0):
            log.info("parent dense network disagrees with the model; tracing", extra=kv(parent=parent.version, head=h))
            return None
    return scripted, spec


def export_bundle(
    src: CheckpointSource,
    staging: Path,
    version: str,
    cfg: DeliveryConfig,
    parent: ParentState | None = None,
    cache: ExportCache | None = None,
    progress: ProgressHook | None = None,
) -> BundleManifest:
    """Write a bundle of checkpoint ``src`` into ``staging`` (full, or a delta on ``parent``).

    Args:
        src: the checkpoint.
        staging: an empty directory (the publisher's ``.vNNNNNN.tmp``).
        version: the version name this bundle will be published as.
        cfg: delivery config (dtype, map size).
        parent: the published parent for an incremental bundle; None = full.
        cache: a long-lived process's :class:`~delivery.reuse.ExportCache` (parsed configs,
            the built model, the traced dense network, live ids; see that module); every
            check runs as without it. The written bundle's dense network and live ids are
            put back into it, keyed by the sha256 of the files written.
        progress: told ``(DeliverStage.EXPORT, rows done, rows to export)`` before the first
            table and after each, then ``DeliverStage.DENSE`` as one step (see the module
            docstring); None: nothing told.

    Nothing is fsynced here: ``staging`` becomes a bundle only through
    ``Publisher.publish``, which fsyncs each of its files once before the rename.

    Returns:
        the manifest written to ``staging/manifest.json``.

    Raises:
        DeliveryError: bad checkpoint contents (missing table, dim mismatch, NaN rows,
            missing dense parameters) or a parent incompatible with this checkpoint.
    """
    t0 = time.perf_counter()
    if parent is not None and parent.spent:
        raise DeliveryError(f"parent state of {parent.version} was spent by the export of {parent.spent} (its live "
                            f"ids were advanced in place); take a new one with parent_state()")
    model, dims = build_trained_model(src, cache)
    if parent is not None:
        if parent.dtype != cfg.dtype.value:
            raise DeliveryError(f"parent {parent.version} stores {parent.dtype} rows, this delivery {cfg.dtype.value}")
        for t, dim in dims.items():
            if parent.dims.get(t) != dim:
                raise DeliveryError(
                    f"table '{t}': dim {dim} in {src.path} but {parent.dims.get(t)} in parent {parent.version}"
                )
    deltas = src.deltas_after(parent) if parent is not None else None
    order = sorted(dims, key=table_prefix)  # global key order -> append-mode writes
    changes = src.changes_many(order, deltas) if parent is not None and deltas is not None else None
    writer = EmbeddingWriter(staging / EMBEDDINGS, cfg.dtype, cfg.map_size_gb)
    tables: dict[str, TableInfo] = {}
    removed: dict[str, np.ndarray] = {}
    watermark = parent.watermark if parent is not None else -1
    written_total = 0
    at: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # per table: written rows' places in the parent's ids
    rows_total = (sum(int(changes[t][0].ids.shape[0]) for t in order) if changes is not None
                  else _manifest_rows(src.manifest, order))
    rows_done = 0
    if progress is not None:
        progress(DeliverStage.EXPORT, 0, rows_total)
    try:
        for t in order:
            if parent is not None and changes is not None:  # only the changed data is read
                from ps.checkpoint import in_sorted

                p_ids, p_fp = parent.live.get(t, (np.zeros(0, np.int64), np.zeros(0, np.uint64)))
                data, removed_since = changes[t]
                if data.last_step.size:
                    watermark = max(watermark, int(data.last_step.max()))
                stored = np.ascontiguousarray(data.raw_weights, dtype=cfg.dtype.numpy.newbyteorder("<"))
                fp = row_fingerprints(stored)[data.order]
                pos, known = locate(p_ids, data.ids)  # the one search of the parent's ids
                changed = np.flatnonzero(changed_since(p_ids, p_fp, data.ids, fp, located=(pos, known)))
                sel_ids, sel_rows = data.ids[changed], data.weights(changed)
                at[t] = (pos[changed], known[changed])
                gone = removed_since[in_sorted(removed_since, p_ids)]  # ids the parent served
                removed[t] = gone
                new_ids = int(np.count_nonzero(~known))
                try:
                    writer.write_table(t, sel_ids, sel_rows, fingerprints=fp[changed])
                except DeliveryError as exc:
                    raise DeliveryError(f"checkpoint {src.path}: {exc}") from None
                written_total += sel_ids.shape[0]
                tables[t] = TableInfo(dim=dims[t], rows=int(p_ids.shape[0] - gone.shape[0] + new_ids),
                                      written=int(sel_ids.shape[0]), removed=int(gone.shape[0]))
                rows_done += int(data.ids.shape[0])
                _told(progress, rows_done, rows_total)
                continue
            data = src.table(t)
            if data.last_step.size:
                watermark = max(watermark, int(data.last_step.max()))
            if parent is None:
                sel_ids, sel_rows = data.ids, data.weights()
                gone = np.zeros(0, np.int64)
            else:
                p_ids, p_fp = parent.live.get(t, (np.zeros(0, np.int64), np.zeros(0, np.uint64)))
                stored = np.ascontiguousarray(data.raw_weights, dtype=cfg.dtype.numpy.newbyteorder("<"))
                fp = row_fingerprints(stored)[data.order]  # permute 8 bytes/row, not the rows
                changed = np.flatnonzero(changed_since(p_ids, p_fp, data.ids, fp))
                sel_ids, sel_rows = data.ids[changed], data.weights(changed)
                gone = np.setdiff1d(p_ids, data.ids, assume_unique=True)
                removed[t] = gone
            try:
                writer.write_table(t, sel_ids, sel_rows)
            except DeliveryError as exc:
                raise DeliveryError(f"checkpoint {src.path}: {exc}") from None
            written_total += sel_ids.shape[0]
            tables[t] = TableInfo(dim=dims[t], rows=int(data.ids.shape[0]), written=int(sel_ids.shape[0]),
                                  removed=int(gone.shape[0]))
            rows_done += int(data.ids.shape[0])
            _told(progress, rows_done, rows_total)
    finally:
        writer.close(fsync=False)  # staging: Publisher.publish fsyncs every file once
    if parent is not None:
        write_removed(staging / REMOVED, removed)
    if progress is not None:
        progress(DeliverStage.EXPORT, rows_done, rows_done)
        progress(DeliverStage.DENSE, 0, 1)
    reused = _reuse_parent_dense(model, src, dims, parent, cache)
    scripted, spec = reused if reused is not None else trace_dense(model, src.schema, dims)
    dense_sha = save_scripted(scripted, str(staging / DENSE))
    info = src.info
    from delivery.adapt import adapt_recipe, learned_rate_names, learned_values, write_adapt_params

    if cache is not None:  # parsed once per distinct config text (a job's checkpoints share it)
        def make_recipe() -> tuple[str, list[str]]:
            r = adapt_recipe(info, list(dims), str(src.path))
            return canonical(r), learned_rate_names(src, model, r)

        job = info.get("job") or {}
        recipe_key = canonical([src.config_key, info.get("meta"), job.get("meta"), job.get("ps"), list(dims)])
        recipe, rate_names = cache.recipe(recipe_key, make_recipe)
    else:
        recipe = adapt_recipe(info, list(dims), str(src.path))
        rate_names = learned_rate_names(src, model, recipe)
    write_adapt_params(model, staging, learned_values(src, rate_names))
    files = checksum_files(staging, known={DENSE: dense_sha})
    manifest = BundleManifest(
        version=version,
        kind=BundleKind.FULL if parent is None else BundleKind.DELTA,
        parent=None if parent is None else parent.version,
        base=version if parent is None else parent.base,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        source={"checkpoint": str(src.path.resolve()), "step": src.step, "row_watermark": watermark,
                "num_shards": src.manifest.get("shards"), "ckpt_id": src.manifest.get("ckpt_id"),
                "read": "changes" if deltas is not None else "all",
                "dense": "parent's graph" if reused is not None else "traced"},
        data_range=info.get("data_range"),
        metrics=dict(info.get("metrics") or {}),
        schema=src.schema.to_dict(),
        model=dict(info["model"]),
        dtype=cfg.dtype,
        tables=tables,
        dense=spec.to_dict(),
        files=files,
        adapt=recipe,
    )
    write_manifest(staging, manifest, fsync=False)  # (fsynced by Publisher.publish)
    if progress is not None:
        progress(DeliverStage.DENSE, 1, 1)
    if cache is not None:
        cache.put_dense(files[DENSE], scripted)
        key: LiveKey = ((version, files[INDEX], files.get(REMOVED, "")),)
        if parent is None:
            cache.put_live(key, dict(writer.index))
        else:
            # the parent's entry is taken out and its arrays updated into this version's (no
            # 16 B/row copy); the ParentState is spent (export_bundle refuses it from now on)
            owned = cache.take_live(parent.live_key) is parent.live
            live = advance_live(parent.live, writer.index, removed, at=at if changes is not None else None,
                                inplace=owned)
            if owned:
                parent.spent = version
            cache.put_live(key + parent.live_key, live)
    log.info(
        "bundle exported",
        extra=kv(version=version, kind=manifest.kind.value, checkpoint=src.path, rows_written=written_total,
                 read=manifest.source["read"], deltas_read=len(deltas or []),
                 removed=sum(len(v) for v in removed.values()), seconds=round(time.perf_counter() - t0, 3)),
    )
    return manifest
