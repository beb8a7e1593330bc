"""Zero-copy reader of a Meta-IO dataset: memory-mapped IPC record batches -> torch.

Opening a dataset reads ``manifest.json`` and ``index.arrow`` only; each data
file is memory-mapped (``pa.memory_map`` + ``ipc.open_file``) the first time a
batch of it is read. A record batch becomes a :class:`~meta_io.batch.MetaBatch`
(meta layout) or :class:`~meta_io.batch.PlainBatch` (plain layout, leftover
files) with no per-row Python.

Integrity (see :mod:`meta_io.integrity`): opening checks ``index.arrow``
against the manifest's crc32; opening a data file checks its size, footer and
frame crc32; each record batch (and its unique-ids batch) is checked against
its index crc32 the first time it is read -- a flipped byte is a DataError
naming the file and the batch. A dataset without checksums (older builds)
reads with a warning.

Packed batches (format 2, :mod:`meta_io.packing`): the numeric columns are
stored as one block per dtype, so a meta batch costs one DLPack per block
(int64, float32), one bit-unpack of ``__mask``, then per half one
``split_with_sizes`` per block: every column is a view out of that split.
Format 1 datasets (one column per feature: ``pack_columns = False`` or older
builds) still read, through :meth:`BatchConverter.features`.

What is zero-copy (tensors are views of the mapped file, measured in
tests/meta_io/test_reader.py)::

    ids[col]       int64   [T, c, max_len] -> support/query are slices   zero-copy
    vectors[col]   float32                                                zero-copy
    labels, oracle float32                                                zero-copy
    scenario       int64 (when the scenario column is an id column)       zero-copy
    task_keys      int64 [T] (a strided view of __task_key)               zero-copy
    dense          float32 [.., n_dense]: one slice of the float block    copy (as in format 1: writable)
    mask           bool: Arrow packs booleans as bits                     copy
    unique_ids     precomputed by the build (*.ids.arrow sidecar)         zero-copy

In a packed dataset the views are strided: a column's rows are one block row
apart (``stride(-2)`` is the block width), values are the same as format 1's
(tested value by value in tests/meta_io/test_packed.py).

The views are read-only memory: a consumer must not write into them (copy
first, e.g. ``batch.map(torch.clone)``). ``torch.from_dlpack`` is used rather
than ``torch.from_numpy`` because the latter warns on read-only arrays.

Example::

    ds = MetaIODataset("runs/main/metaio")
    for batch in prefetch(ds.read_range(file=0, start=10, stop=20)):
        batch.support.ids["item_id"].shape      # [T, S_c, 1]
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from meta_io import integrity
from meta_io import layout as L
from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from meta_io.index import CHECKSUM_COLUMNS, BatchIndex
from meta_io.integrity import BatchChecker
from meta_io.layout import BatchKind
from meta_io.packing import PACKED_FORMAT_VERSION, UNPACKED_FORMAT_VERSION, Block, Packing, logical_schemas, unpack
from meta_io.source import normalized_arrow_schema
from meta_io.schema import LIST_KINDS, ColumnKind, Schema, schema_from_dict
from common.errors import DataError, SchemaError
from common.lazy import LazyModule
from common.log import kv

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch", globals())  # the controller and launcher read datasets without tensors

log = logging.getLogger(__name__)


def arrow_to_torch(arr: pa.Array) -> torch.Tensor:
    """One Arrow column as a tensor: ``[n]`` or ``[n, list_size]`` for fixed-size lists.

    Zero-copy (DLPack) for numeric columns without nulls; booleans (bit-packed
    in Arrow) are unpacked into a new tensor.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_fixed_size_list(arr.type):
        # .values is the whole child array; flatten() honours a sliced parent
        inner = arrow_to_torch(arr.values if arr.offset == 0 and len(arr.values) == len(arr) * arr.type.list_size
                               else arr.flatten())
        return inner.view(len(arr), arr.type.list_size)
    if pa.types.is_boolean(arr.type):
        return torch.from_numpy(arr.to_numpy(zero_copy_only=False))
    if len(arr) == 0:
        return torch.empty(0, dtype=_torch_dtype(arr.type))
    if arr.null_count:
        raise DataError(f"column of type {arr.type} has {arr.null_count} nulls; Meta-IO files never hold nulls")
    return torch.from_dlpack(arr)


def _torch_dtype(t: pa.DataType) -> torch.dtype:
    """The torch dtype of a Meta-IO column type (a function, not a module-level table: no torch at import)."""
    return {pa.int64(): torch.int64, pa.int32(): torch.int32, pa.float32(): torch.float32,
            pa.float64(): torch.float64}[t]


class BatchConverter:
    """Turns record batches of one dataset's schema into torch batches.

    Args:
        schema: the dataset's schema (from its manifest).
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.id_cols = schema.id_columns
        self.dense_cols = [c.name for c in schema.dense_columns]
        self.vector_cols = [c.name for c in schema.vector_columns]
        self._id_names = [c.name for c in self.id_cols]
        self.tables: dict[str, list[str]] = {}
        for c in self.id_cols:
            self.tables.setdefault(c.table_name, []).append(c.name)
        self.scenario_kind = schema.column(schema.scenario).kind if schema.scenario else None
        # a sparse scenario column is already converted as an id column: reuse that view
        self.scenario_is_id = self.scenario_kind == ColumnKind.SPARSE
        # (column, list width or 0 for a single id): decided once, not per batch
        self._id_plan = [(c.name, c.max_len if c.kind in LIST_KINDS else 0) for c in self.id_cols]
        self._plans: dict[int, _PackedPlan] = {}

    def _prepared(self, packing: Packing) -> "_PackedPlan":
        plan = self._plans.get(id(packing))
        if plan is None or plan.packing is not packing:
            plan = self._plans[id(packing)] = _PackedPlan(self, packing)
        return plan

    def features(self, rb: pa.RecordBatch, shape: tuple[int, ...]) -> FeatureBatch:
        """All features of a logical (format 1, unpacked) ``rb`` with leading shape ``shape``.

        The hot path of the reader: about three Python-level ops per column
        (look-up, DLPack, view), nothing per row.
        """
        cols = dict(zip(rb.schema.names, rb.columns))
        ids = {}
        for name, width in self._id_plan:
            a = cols[name]
            if width:  # fixed-size list: the child values, [rows * width]
                a = a.values if a.offset == 0 else a.flatten()
                ids[name] = torch.from_dlpack(a).view(*shape, width)
            else:
                ids[name] = torch.from_dlpack(a).view(*shape, 1)
        if self.dense_cols:
            dense = torch.stack([torch.from_dlpack(cols[n]) for n in self.dense_cols], dim=-1)
            dense = dense.view(*shape, len(self.dense_cols))
        else:
            dense = torch.zeros(*shape, 0)
        vectors = {n: arrow_to_torch(cols[n]).view(*shape, -1) for n in self.vector_cols}
        labels = {lab: torch.from_dlpack(cols[lab]).view(shape) for lab in self.schema.labels}
        oracle = {lab: torch.from_dlpack(cols[name]).view(shape) for lab, name in self.schema.oracle.items()}
        mask = arrow_to_torch(cols[L.MASK_COL]).view(shape)
        if self.scenario_kind is None:
            scenario = torch.zeros(shape, dtype=torch.int64)
        elif self.scenario_is_id:
            scenario = ids[self.schema.scenario][..., 0]
        else:
            scenario = arrow_to_torch(cols[self.schema.scenario]).view(shape)
            if scenario.dtype != torch.int64:
                scenario = scenario.to(torch.int64)
        return FeatureBatch(ids=ids, dense=dense, vectors=vectors, labels=labels, mask=mask,
                            scenario=scenario, oracle=oracle)

    def unique_ids(self, *fbs: FeatureBatch) -> dict[str, torch.Tensor]:
        """table -> sorted unique ids (>= 0) over every id column of that table (of all ``fbs``)."""
        out = {}
        for table, cols in self.tables.items():
            flat = torch.cat([fb.ids[c].reshape(-1) for fb in fbs for c in cols])
            u = torch.unique(flat, sorted=True)
            out[table] = u[int(torch.searchsorted(u, 0)) :]  # sorted: drop the -1 padding prefix
        return out

    def plain(self, rb: pa.RecordBatch, unique: dict[str, torch.Tensor] | None = None,
              packing: Packing | None = None) -> PlainBatch:
        """A plain record batch; ``unique`` = precomputed unique ids (computed here if None).

        ``packing``: the file's plan when ``rb`` is stored packed (format 2).
        """
        if packing is not None:
            fb = self._prepared(packing).plain(rb)
        else:
            fb = self.features(rb, (rb.num_rows,))
        return PlainBatch(features=fb, unique_ids=unique if unique is not None else self.unique_ids(fb))

    def meta(
        self,
        rb: pa.RecordBatch,
        task_slots: int,
        capacity: int,
        support: int,
        unique: dict[str, torch.Tensor] | None = None,
        packing: Packing | None = None,
    ) -> MetaBatch:
        """A meta record batch of ``task_slots`` tasks of ``capacity`` slots, ``support`` of them support.

        ``unique``: the batch's unique ids from the sidecar file (computed here if None).
        ``packing``: the file's plan when ``rb`` is stored packed (format 2).
        """
        if packing is not None:
            sup, qry, keys1, task_mask = self._prepared(packing).meta(rb, task_slots, capacity, support)
            return MetaBatch(support=sup, query=qry, task_keys=keys1, task_mask=task_mask,
                             unique_ids=unique if unique is not None else self.unique_ids(sup, qry))
        shape = (task_slots, capacity)
        full = self.features(rb, shape)
        keys = arrow_to_torch(rb.column(L.TASK_KEY_COL)).view(shape)
        return MetaBatch(
            support=_half(full, slice(None, support)),
            query=_half(full, slice(support, None)),
            task_keys=keys[:, 0],
            task_mask=full.mask[:, 0].clone(),
            unique_ids=unique if unique is not None else self.unique_ids(full),
        )


class _PackedPlan:
    """Where each feature lives in the packed blocks of one file kind; decided once per plan.

    Per batch: one DLPack per used block (and one bit-unpack of ``__mask``),
    then per half one slice and one ``torch.split`` per block; every column is
    a view from the split (dict look-ups only, no tensor op per column except
    the few labels' ``squeeze`` and ``dense``'s one copy, as in format 1).

    Args:
        conv: the converter (schema roles).
        packing: the file kind's plan.

    Raises:
        DataError: a feature column of the schema is not in a block.
    """

    def __init__(self, conv: BatchConverter, packing: Packing) -> None:
        self.packing = packing
        stored = packing.stored_names
        where: dict[str, tuple[int, int, int, int]] = {}  # column -> (block slot, member index, offset, width)
        needed = set(conv._id_names) | set(conv.dense_cols) | set(conv.vector_cols) | set(conv.schema.labels)
        needed |= set(conv.schema.oracle.values()) | {L.TASK_KEY_COL}
        if conv.schema.scenario:
            needed.add(conv.schema.scenario)
        used: list[Block] = []
        for b in packing.blocks:
            if not any(m.name in needed for m in b.members):
                continue  # e.g. the int32 block of __task/__slot: never converted
            for k, m in enumerate(b.members):
                where[m.name] = (len(used), k, m.offset, m.width)
            used.append(b)
        missing = sorted(n for n in needed - {L.TASK_KEY_COL} if n not in where)
        if missing:
            raise DataError(f"packing plan has no block for feature columns {missing}")
        self.blocks = [(stored.index(b.name), b.width) for b in used]  # (stored column, width)
        self.widths = [[m.width for m in b.members] for b in used]
        self.mask_idx = stored.index(L.MASK_COL)
        self.ids = [(n, where[n][0], where[n][1]) for n in conv._id_names]
        self.vectors = [(n, where[n][0], where[n][1]) for n in conv.vector_cols]
        self.labels = [(lab, where[lab][0], where[lab][1]) for lab in conv.schema.labels]
        self.oracle = [(lab, where[c][0], where[c][1]) for lab, c in conv.schema.oracle.items()]
        dl = [where[n] for n in conv.dense_cols]
        # dense: one slice of one block when its members are adjacent (role_order makes them so)
        self.dense_slice = (dl[0][0], dl[0][2], dl[-1][2] + dl[-1][3]) if dl and all(
            d[0] == dl[0][0] and d[3] == 1 and d[2] == dl[0][2] + j for j, d in enumerate(dl)) else None
        self.dense_each = [(d[0], d[2]) for d in dl]
        self.task_key = (where[L.TASK_KEY_COL][0], where[L.TASK_KEY_COL][2]) if L.TASK_KEY_COL in where else None
        self.scenario_is_id = conv.scenario_is_id
        self.scenario = conv.schema.scenario
        self.scenario_loc = (where[self.scenario][0], where[self.scenario][1]) if self.scenario else None

    def _blocks(self, rb: pa.RecordBatch, shape: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor]:
        n = rb.num_rows
        blocks = []
        for i, w in self.blocks:
            a = rb.column(i)
            v = a.values  # the child [rows * w]: exactly the block when not sliced (always so from a file)
            blocks.append((torch.from_dlpack(v) if a.offset == 0 and len(v) == n * w else arrow_to_torch(a))
                          .view(*shape, w))
        return blocks, arrow_to_torch(rb.column(self.mask_idx)).view(shape)

    def _dense(self, blocks: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        if self.dense_slice is not None:
            j, a, b = self.dense_slice
            return blocks[j][..., a:b].clone()  # a copy, as in format 1 (consumers may write into it)
        if self.dense_each:
            return torch.stack([blocks[j][..., o] for j, o in self.dense_each], dim=-1)
        return torch.zeros(*shape, 0)

    def _features(self, blocks: list[torch.Tensor], dense: torch.Tensor, mask: torch.Tensor) -> FeatureBatch:
        # one C call per block returns every member's view (torch.split's Python wrapper costs as much again)
        parts = [b.split_with_sizes(w, -1) for b, w in zip(blocks, self.widths)]
        ids = {n: parts[j][k] for n, j, k in self.ids}
        if not self.scenario:
            scenario = torch.zeros(mask.shape, dtype=torch.int64)
        elif self.scenario_is_id:
            scenario = ids[self.scenario].select(-1, 0)
        else:
            assert self.scenario_loc is not None
            scenario = parts[self.scenario_loc[0]][self.scenario_loc[1]].select(-1, 0)
            if scenario.dtype != torch.int64:
                scenario = scenario.to(torch.int64)
        return FeatureBatch(
            ids=ids,
            dense=dense,
            vectors={n: parts[j][k] for n, j, k in self.vectors},
            labels={n: parts[j][k].select(-1, 0) for n, j, k in self.labels},
            mask=mask,
            scenario=scenario,
            oracle={n: parts[j][k].select(-1, 0) for n, j, k in self.oracle},
        )

    def plain(self, rb: pa.RecordBatch) -> FeatureBatch:
        shape = (rb.num_rows,)
        blocks, mask = self._blocks(rb, shape)
        return self._features(blocks, self._dense(blocks, shape), mask)

    def meta(self, rb: pa.RecordBatch, task_slots: int, capacity: int,
             support: int) -> tuple[FeatureBatch, FeatureBatch, torch.Tensor, torch.Tensor]:
        """(support, query, task keys [T], task mask [T]) of a packed meta record batch."""
        shape = (task_slots, capacity)
        blocks, mask = self._blocks(rb, shape)
        dense = self._dense(blocks, shape)
        if self.task_key is None:
            raise DataError("packed meta record batch without a __task_key member")
        j, off = self.task_key
        keys = blocks[j].select(1, 0).select(-1, off)
        sizes = [support, capacity - support]  # support | query slots: one C call per tensor, no indexing
        halves = [b.split_with_sizes(sizes, 1) for b in blocks]
        dense_s, dense_q = dense.split_with_sizes(sizes, 1)
        mask_s, mask_q = mask.split_with_sizes(sizes, 1)
        sup = self._features([h[0] for h in halves], dense_s, mask_s)
        qry = self._features([h[1] for h in halves], dense_q, mask_q)
        return sup, qry, keys, mask.select(1, 0).clone()


def _half(fb: FeatureBatch, part: slice) -> FeatureBatch:
    """Slots ``part`` of every task: strided views, no copy."""
    return FeatureBatch(
        ids={k: v[:, part] for k, v in fb.ids.items()},
        dense=fb.dense[:, part],
        vectors={k: v[:, part] for k, v in fb.vectors.items()},
        labels={k: v[:, part] for k, v in fb.labels.items()},
        mask=fb.mask[:, part],
        scenario=fb.scenario[:, part],
        oracle={k: v[:, part] for k, v in fb.oracle.items()},
    )


class _File:
    """A lazily opened, memory-mapped data file (and its unique-ids sidecar)."""

    def __init__(self, path: Path, n_batches: int, n_bytes: int, columns: list[str],
                 ids_path: Path | None, ids_bytes: int, tables: list[str],
                 checker: BatchChecker | None = None, ids_checker: BatchChecker | None = None,
                 packing: Packing | None = None, logical: pa.Schema | None = None) -> None:
        self.path = path
        self.packing = packing
        self.logical = logical
        self.n_batches = n_batches
        self.n_bytes = n_bytes
        self.columns = columns
        self.ids_path = ids_path
        self.ids_bytes = ids_bytes
        self.tables = tables
        self.checker = checker
        self.ids_checker = ids_checker
        self.reader: ipc.RecordBatchFileReader | None = None
        self.ids_reader: ipc.RecordBatchFileReader | None = None

    @staticmethod
    def _open_ipc(p: Path, n_bytes: int, n_batches: int, columns: list[str], what: str) -> ipc.RecordBatchFileReader:
        if not p.exists():
            raise DataError(f"{p}: {what} listed in the manifest is missing")
        size = p.stat().st_size
        if n_bytes and size != n_bytes:
            raise DataError(f"{p}: truncated or modified: manifest says {n_bytes} bytes, file has {size}")
        try:
            reader = ipc.open_file(pa.memory_map(str(p)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{p}: corrupt Arrow IPC file: {exc}") from None
        if reader.num_record_batches != n_batches:
            raise DataError(f"{p}: expected {n_batches} record batches (index), file has {reader.num_record_batches}")
        if reader.schema.names != columns:
            raise DataError(f"{p}: columns {reader.schema.names} do not match the manifest's {columns}")
        return reader

    def open(self) -> ipc.RecordBatchFileReader:
        """Map the file (and sidecar): sizes, footers, columns and, with checksums, the frames."""
        if self.reader is None:
            reader = self._open_ipc(self.path, self.n_bytes, self.n_batches, self.columns, "data file")
            if self.packing is not None:
                for b in self.packing.blocks:
                    got = reader.schema.field(b.name).type
                    if got != b.arrow_type:
                        raise DataError(f"{self.path}: packed column {b.name} is {got}, the manifest's packing plan "
                                        f"says {b.arrow_type}")
            if self.checker is not None:
                self.checker.check_frame()
            if self.ids_path is not None:
                self.ids_reader = self._open_ipc(self.ids_path, self.ids_bytes, self.n_batches, ["ids"],
                                                 "unique-ids file")
                if self.ids_checker is not None:
                    self.ids_checker.check_frame()
            self.reader = reader
        return self.reader

    def batch(self, i: int) -> pa.RecordBatch:
        """Record batch ``i``; its checksum is checked the first time it is read."""
        reader = self.open()
        if self.checker is not None:
            self.checker.check(i)
        try:
            return reader.get_batch(i)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{self.path}: corrupt record batch {i}: {exc}") from None

    def logical_batch(self, i: int) -> pa.RecordBatch:
        """Record batch ``i`` with one column per logical column (unpacked: a copy when stored packed)."""
        rb = self.batch(i)
        if self.packing is None or self.logical is None:
            return rb
        return unpack(rb, self.packing, self.logical)

    def verify(self) -> None:
        """Every byte of the file and its sidecar against the checksums (``inspect --verify``)."""
        self.open()
        for c in (self.checker, self.ids_checker):
            if c is not None:
                c.check_all()

    def unique_ids(self, i: int, offsets: list[int]) -> dict[str, torch.Tensor] | None:
        """table -> sorted unique ids of batch ``i`` from the sidecar (None without one).

        One DLPack view of the batch's concatenated ids, then one ``torch.split`` into the tables.
        """
        self.open()
        if self.ids_reader is None:
            return None
        if self.ids_checker is not None:
            self.ids_checker.check(i)
        try:
            col = self.ids_reader.get_batch(i).column(0)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{self.ids_path}: corrupt record batch {i}: {exc}") from None
        if len(offsets) != len(self.tables) + 1 or offsets[-1] != len(col):
            raise DataError(f"{self.ids_path}: record batch {i} holds {len(col)} ids, index offsets say {offsets}")
        sizes = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        return dict(zip(self.tables, arrow_to_torch(col).split_with_sizes(sizes)))  # one call: every table's slice


class MetaIODataset:
    """A built Meta-IO dataset folder, opened for reading.

    Args:
        path: the folder ``metaps meta-io build`` wrote.

    Raises:
        DataError: no manifest (an incomplete build), a corrupt manifest or index,
            or an index that disagrees with the manifest.

    Example::

        ds = MetaIODataset("metaio/")
        shards = [(f, 0, ds.num_batches(f)) for f in range(ds.num_files)]
        batch = next(ds.read_range(*shards[0]))
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        mpath = self.path / L.MANIFEST_NAME
        if not self.path.is_dir():
            raise DataError(f"{self.path}: Meta-IO dataset folder not found")
        if not mpath.exists():
            raise DataError(
                f"{mpath}: manifest not found: {self.path} is not a complete Meta-IO dataset "
                "(a build writes its manifest last)"
            )
        try:
            manifest = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"{mpath}: corrupt manifest: {exc}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != "metaio":
            raise DataError(f"{mpath}: not a Meta-IO manifest (no \"format\": \"metaio\")")
        version = manifest.get("format_version")
        if version not in (UNPACKED_FORMAT_VERSION, PACKED_FORMAT_VERSION):
            raise DataError(
                f"{mpath}: format_version {version!r} is not supported (this reader reads "
                f"{UNPACKED_FORMAT_VERSION}: one column per feature, and {PACKED_FORMAT_VERSION}: packed blocks); "
                "rebuild the dataset with this metaps"
            )
        self.manifest: dict[str, Any] = manifest
        try:
            self.schema: Schema = schema_from_dict(manifest["schema"], where=f"{mpath}: schema")
            self.layout: str = L.Layout(manifest["layout"]).value
            columns = list(manifest["columns"])
            files, left = manifest["files"], manifest.get("leftover_files", [])
        except (KeyError, ValueError, SchemaError) as exc:
            raise DataError(f"{mpath}: malformed manifest: {exc}") from None
        self.packing = self._packing(mpath, manifest, version, columns)
        self.has_checksums = integrity.MANIFEST_KEY in manifest
        if self.has_checksums:
            try:
                integrity.check_whole_file(self.path / L.INDEX_NAME, int(manifest["index_crc32"]),
                                           int(manifest["index_bytes"]), "index file")
            except (KeyError, TypeError, ValueError) as exc:
                raise DataError(f"{mpath}: malformed manifest: checksums without index_crc32/index_bytes "
                                f"({exc})") from None
        else:
            log.warning("Meta-IO dataset has no checksums (built by an older metaps): corruption inside its "
                        "files is not detected; rebuild it to add checksums", extra=kv(dataset=str(self.path)))
        self.index = BatchIndex.read(self.path / L.INDEX_NAME)
        if self.has_checksums and not self.index.has_checksums:
            raise DataError(f"{self.path / L.INDEX_NAME}: the manifest declares checksums but the index lacks "
                            f"columns {list(CHECKSUM_COLUMNS)}")
        main_kind = BatchKind.META if self.layout == L.Layout.META.value else BatchKind.PLAIN
        main_cols = [n for n, _ in (L.META_COLUMNS if main_kind == BatchKind.META else L.PLAIN_COLUMNS)]
        plain_cols = [n for n, _ in L.PLAIN_COLUMNS]
        # per file: index positions of its batches, in batch order
        self._rows = [self.index.rows_of(main_kind, i) for i in range(len(files))]
        self._left_rows = [self.index.rows_of(BatchKind.LEFTOVER, i) for i in range(len(left))]
        try:
            self._files = [self._file(f, columns + main_cols, r, "main") for f, r in zip(files, self._rows)]
            self._leftover = [self._file(f, columns + plain_cols, r, "leftover") for f, r in zip(left, self._left_rows)]
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{mpath}: malformed manifest file entry: {exc}") from None
        for f, rows in zip(self._files + self._leftover, self._rows + self._left_rows):
            if rows.size != f.n_batches:
                raise DataError(
                    f"{self.path / L.INDEX_NAME}: lists {rows.size} batches of {f.path.name}, manifest says {f.n_batches}"
                )
        self._kind = main_kind
        self.converter = BatchConverter(self.schema)
        self._lock = threading.Lock()

    def _packing(self, mpath: Path, manifest: dict[str, Any], version: int,
                 columns: list[str]) -> dict[str, tuple[Packing, pa.Schema]]:
        """File kind -> (packing plan, logical schema) of a packed dataset; {} for format 1."""
        plans = manifest.get("packing")
        if version == UNPACKED_FORMAT_VERSION:
            if plans is not None:
                raise DataError(f"{mpath}: format_version {version} (unpacked) but the manifest has a packing plan")
            return {}
        if not isinstance(plans, dict):
            raise DataError(f"{mpath}: format_version {version} needs a \"packing\" entry (the packed columns' plan)")
        logical = logical_schemas(normalized_arrow_schema(self.schema), self.layout)
        if list(logical["main"].names[: len(columns)]) != columns:
            raise DataError(f"{mpath}: columns {columns} do not match the schema's {logical['main'].names}")
        out = {}
        for kind, sch in logical.items():
            if kind not in plans:
                raise DataError(f"{mpath}: packing plan for '{kind}' files is missing")
            p = Packing.from_dict(plans[kind], f"{mpath}: packing[{kind!r}]")
            if list(p.columns) != sch.names:
                raise DataError(f"{mpath}: packing[{kind!r}] covers columns {list(p.columns)}, expected {sch.names}")
            out[kind] = (p, sch)
        return out

    def _file(self, entry: dict[str, Any], columns: list[str], rows: np.ndarray, kind: str) -> _File:
        ids = entry.get("ids")
        packing, logical = self.packing.get(kind, (None, None))
        if packing is not None:
            columns = packing.stored_names
        path = self.path / entry["name"]
        checker = ids_checker = None
        if self.has_checksums:
            c = self.index.cols
            checker = BatchChecker(path, c["byte_offset"][rows], c["byte_length"][rows], c["crc32"][rows],
                                   int(entry["frame_crc32"]))
            if ids:
                ids_checker = BatchChecker(self.path / ids, c["ids_byte_offset"][rows], c["ids_byte_length"][rows],
                                           c["ids_crc32"][rows], int(entry["ids_frame_crc32"]))
        return _File(path, int(entry["batches"]), int(entry.get("bytes") or 0), columns,
                     self.path / ids if ids else None, int(entry.get("ids_bytes") or 0),
                     list(L.id_tables(self.schema)), checker, ids_checker, packing, logical)

    # -- shape --------------------------------------------------------------------------
    @property
    def num_files(self) -> int:
        """Data files (``part-*.arrow``), the units data shards index into."""
        return len(self._files)

    def num_batches(self, file: int) -> int:
        """Record batches in data file ``file``."""
        self._check_file(file)
        return self._files[file].n_batches

    @property
    def total_batches(self) -> int:
        return sum(f.n_batches for f in self._files)

    @property
    def file_names(self) -> list[str]:
        return [f.path.name for f in self._files]

    def _check_file(self, file: int) -> None:
        if not 0 <= file < len(self._files):
            raise IndexError(f"{self.path}: file {file} out of range [0, {len(self._files)})")

    # -- reading ------------------------------------------------------------------------
    def read_range(self, file: int, start: int, stop: int) -> Iterator[MetaBatch | PlainBatch]:
        """Record batches ``[start, stop)`` of data file ``file`` (one data shard).

        Raises:
            IndexError: ``file`` or the range is out of bounds.
            DataError: the file is missing, truncated or corrupt (named).
        """
        self._check_file(file)
        n = self._files[file].n_batches
        if not 0 <= start <= stop <= n:
            raise IndexError(f"{self._files[file].path}: batch range [{start}, {stop}) not within [0, {n}]")
        return self._iter(self._files[file], self._rows[file], start, stop)

    def iter_all(self) -> Iterator[MetaBatch | PlainBatch]:
        """Every record batch of every data file, in file then batch order."""
        for i in range(self.num_files):
            yield from self.read_range(i, 0, self.num_batches(i))

    def leftover(self) -> Iterator[PlainBatch]:
        """The leftover rows of a meta layout (tasks of one row), as plain batches."""
        for f, rows in zip(self._leftover, self._left_rows):
            for batch in self._iter(f, rows, 0, f.n_batches):
                if not isinstance(batch, PlainBatch):
                    raise DataError(f"{f.path}: leftover file holds a meta batch, expected plain batches")
                yield batch

    def _iter(self, f: _File, rows: np.ndarray, start: int, stop: int) -> Iterator[MetaBatch | PlainBatch]:
        with self._lock:
            f.open()
        cols = self.index.cols
        for b in range(start, stop):
            pos = rows[b]
            rb = f.batch(b)
            expect = int(cols["n_slots"][pos])
            if rb.num_rows != expect:
                raise DataError(f"{f.path}: record batch {b} has {rb.num_rows} rows, index says {expect}")
            unique = f.unique_ids(b, self.index.ids_offsets[pos].tolist())
            if self.index.kind[pos] == BatchKind.META.value:
                yield self.converter.meta(
                    rb, int(cols["task_slots"][pos]), int(cols["capacity"][pos]), int(cols["support"][pos]), unique,
                    f.packing,
                )
            else:
                yield self.converter.plain(rb, unique, f.packing)

    def check_files(self) -> None:
        """Open every data and leftover file (footer only): present, complete, as indexed.

        With checksums, each file's frame (footer, magic) is checked too; the
        record batches are not read (see :meth:`verify`).
        """
        with self._lock:
            for f in self._files + self._leftover:
                f.open()

    def verify(self) -> list[str]:
        """Check every byte of every data, leftover and sidecar file against the checksums.

        Returns:
            one problem per bad file (naming it and the record batch); empty when
            all is well. A dataset without checksums yields one problem saying so.
        """
        if not self.has_checksums:
            return [f"{self.path}: no checksums to verify (built by an older metaps); rebuild the dataset"]
        problems = []
        for f in self._files + self._leftover:
            try:
                with self._lock:
                    f.verify()
            except DataError as exc:
                problems.append(str(exc))
        return problems

    def record_batch(self, file: int, batch: int) -> pa.RecordBatch:
        """The logical Arrow record batch, one column per schema/bookkeeping column (for tools and tests).

        In a packed dataset (format 2) the columns are copied out of their blocks;
        :meth:`stored_record_batch` is the batch as stored (memory-mapped).
        """
        self._check_file(file)
        return self._files[file].logical_batch(batch)

    def stored_record_batch(self, file: int, batch: int) -> pa.RecordBatch:
        """The record batch as stored in the file (packed blocks in format 2), memory-mapped."""
        self._check_file(file)
        return self._files[file].batch(batch)

    def leftover_record_batches(self) -> Iterator[pa.RecordBatch]:
        """The leftover files' logical record batches."""
        for f in self._leftover:
            for b in range(f.n_batches):
                yield f.logical_batch(b)
