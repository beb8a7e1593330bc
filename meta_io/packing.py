"""Packed record batches (format 2): same-typed columns stored as one block per batch.

Why: a meta record batch has ~50-100 numeric columns; converting each one to
torch (one DLPack per column, then a view and two half slices) cost ~330 Python
level tensor ops per batch, which competes with the training step for the GIL.
Packed, a batch is a handful of blocks: one DLPack per dtype, then one
``torch.split`` per block and half returns every column as a view.

Layout of a packed record batch (the *logical* columns are the format 1 ones:
every normalized schema column, then the bookkeeping columns)::

    __pack_int64    fixed_size_list<int64>[W_i]    row r = [item_id | tags[0..3] | ... | __task_key]
    __pack_float32  fixed_size_list<float32>[W_f]  row r = [dense_0 .. dense_k | image[0..d) | click | ...]
    __pack_int32    fixed_size_list<int32>[2]      row r = [__task | __slot]
    __is_query, __mask (bool), extra (string) columns: stored as they are

Every numeric logical column (int32/int64/float32/float64, or a fixed-size list
of one) is a member of its dtype's block at a fixed ``offset`` and ``width``
(1, or the list size); members are ordered by role (ids, scenario, dense,
vectors, labels, oracle, then the rest in schema order) so that e.g. the dense
columns are one contiguous slice. So column ``m`` of a block tensor
``[rows, W]`` is ``block[:, m.offset : m.offset + m.width]`` (a strided view).

The plan is recorded in the manifest (``"packing"``, per file kind) and the
reader checks it against each file's schema when it opens the file. Integrity
is unchanged: the crc32 covers the record batch's bytes (the blocks included),
once per batch. :func:`unpack` turns a packed record batch back into the
logical one (a copy: for tools and tests, not for training).

Example::

    p = plan(L.meta_arrow_schema(data_schema), first=role_order(schema))
    packed = p.pack(table)               # writer side, vectorized per column
    logical = unpack(packed_rb, p, logical_schema)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from meta_io import layout as L
from meta_io.schema import Schema
from common.errors import DataError

PACK_PREFIX = "__pack_"

_DTYPES: dict[pa.DataType, str] = {
    pa.int64(): "int64",
    pa.int32(): "int32",
    pa.float32(): "float32",
    pa.float64(): "float64",
}
_ARROW: dict[str, pa.DataType] = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Member:
    """One logical column inside a block: ``block[:, offset : offset + width]``.

    Args:
        name: the logical column.
        offset: first position in the block row.
        width: 1 for a scalar column, the list size for a fixed-size list.
        is_list: the logical column is a fixed-size list (even of size 1).
    """

    name: str
    offset: int
    width: int
    is_list: bool


@dataclass(frozen=True)
class Block:
    """One stored column ``__pack_<dtype>``: a fixed-size list of ``width`` values per row.

    Args:
        dtype: numpy/torch dtype name (``int64``, ``int32``, ``float32``, ``float64``).
        width: values per row (the members' widths summed).
        members: in block order.
    """

    dtype: str
    width: int
    members: tuple[Member, ...]

    @property
    def name(self) -> str:
        return PACK_PREFIX + self.dtype

    @property
    def arrow_type(self) -> pa.DataType:
        return pa.list_(_ARROW[self.dtype], self.width)


@dataclass(frozen=True)
class Packing:
    """How the logical columns of one file kind are stored.

    Args:
        blocks: the packed columns, stored first, in dtype order of first appearance.
        rest: logical columns stored as they are (bool, string, ...), in logical order.
        columns: every logical column, in logical order.
    """

    blocks: tuple[Block, ...]
    rest: tuple[str, ...]
    columns: tuple[str, ...]

    @property
    def stored_names(self) -> list[str]:
        """Column names of the stored (packed) record batches."""
        return [b.name for b in self.blocks] + list(self.rest)

    def stored_schema(self, logical: pa.Schema) -> pa.Schema:
        return pa.schema([pa.field(b.name, b.arrow_type, nullable=False) for b in self.blocks]
                         + [logical.field(n) for n in self.rest])

    def locate(self, name: str) -> tuple[Block, Member]:
        """The block and member of logical column ``name``.

        Raises:
            KeyError: ``name`` is not packed (stored as it is, or unknown).
        """
        for b in self.blocks:
            for m in b.members:
                if m.name == name:
                    return b, m
        raise KeyError(f"column '{name}' is not in a packed block")

    def pack(self, table: pa.Table) -> pa.Table:
        """The stored form of a logical ``table``: one ``[rows, W]`` numpy block per dtype.

        Raises:
            DataError: a numeric column holds nulls (Meta-IO data never does).
        """
        n = table.num_rows
        arrays: list[pa.Array | pa.ChunkedArray] = []
        for b in self.blocks:
            out = np.empty((n, b.width), dtype=np.dtype(b.dtype))
            for m in b.members:  # per column, not per row
                a = table.column(m.name).combine_chunks()
                if a.null_count:
                    raise DataError(f"column '{m.name}' has {a.null_count} nulls; a packed {b.dtype} block holds none")
                if m.is_list:
                    a = a.flatten()
                out[:, m.offset : m.offset + m.width] = a.to_numpy(zero_copy_only=False).reshape(n, m.width)
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(out.reshape(-1)), b.width))
        arrays += [table.column(name) for name in self.rest]
        return pa.Table.from_arrays(arrays, schema=self.stored_schema(table.schema))

    def to_dict(self) -> dict[str, Any]:
        """The manifest entry."""
        return {
            "blocks": [{"name": b.name, "type": b.dtype, "width": b.width,
                        "columns": [[m.name, m.offset, m.width, m.is_list] for m in b.members]} for b in self.blocks],
            "rest": list(self.rest),
            "columns": list(self.columns),
        }

    @staticmethod
    def from_dict(d: Any, where: str) -> "Packing":
        """Parse and check a manifest entry (``where`` names it in errors).

        Raises:
            DataError: malformed, or members that do not tile their block.
        """
        try:
            blocks = []
            for bd in d["blocks"]:
                members = tuple(Member(str(n), int(o), int(w), bool(il)) for n, o, w, il in bd["columns"])
                blk = Block(str(bd["type"]), int(bd["width"]), members)
                if blk.dtype not in _ARROW or bd["name"] != blk.name:
                    raise ValueError(f"block {bd['name']!r} of type {bd['type']!r} is not a packed numeric block")
                pos = 0
                for m in members:
                    if m.offset != pos or m.width < 1:
                        raise ValueError(f"block {blk.name}: member '{m.name}' at offset {m.offset} width {m.width}, "
                                         f"expected offset {pos}")
                    pos += m.width
                if pos != blk.width:
                    raise ValueError(f"block {blk.name}: members cover {pos} values, block width is {blk.width}")
                blocks.append(blk)
            p = Packing(tuple(blocks), tuple(str(n) for n in d["rest"]), tuple(str(n) for n in d["columns"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{where}: malformed packing plan: {exc}") from None
        packed = sorted([m.name for b in p.blocks for m in b.members] + list(p.rest))
        if packed != sorted(p.columns):
            raise DataError(f"{where}: packing plan stores {packed}, the logical columns are {sorted(p.columns)}")
        return p


def role_order(schema: Schema) -> list[str]:
    """Logical columns in the order the reader slices them: ids, scenario, dense, vectors, labels, oracle."""
    names = [c.name for c in schema.id_columns]
    names += [schema.scenario] if schema.scenario else []
    names += [c.name for c in schema.dense_columns] + [c.name for c in schema.vector_columns]
    names += list(schema.labels) + list(schema.oracle.values())
    seen: set[str] = set()
    return [n for n in names if not (n in seen or seen.add(n))]  # type: ignore[func-returns-value]


def plan(logical: pa.Schema, first: Sequence[str] = ()) -> Packing:
    """The packing of ``logical``: numeric columns grouped by dtype, ``first`` names first.

    Args:
        logical: the logical arrow schema (data columns + bookkeeping).
        first: column names to place first in their block, in this order (see :func:`role_order`).
    """
    rank = {n: i for i, n in enumerate(first)}
    order = sorted(range(len(logical)), key=lambda i: (rank.get(logical.field(i).name, len(rank)), i))
    by_dtype: dict[str, list[Member]] = {}
    widths: dict[str, int] = {}
    rest = []
    for i in order:
        f = logical.field(i)
        tp, width, is_list = f.type, 1, False
        if pa.types.is_fixed_size_list(tp):
            tp, width, is_list = tp.value_type, tp.list_size, True
        dt = _DTYPES.get(tp)
        if dt is None:
            continue
        pos = widths.get(dt, 0)
        by_dtype.setdefault(dt, []).append(Member(f.name, pos, width, is_list))
        widths[dt] = pos + width
    packed = {m.name for ms in by_dtype.values() for m in ms}
    rest = [f.name for f in logical if f.name not in packed]
    blocks = tuple(Block(dt, widths[dt], tuple(ms)) for dt, ms in by_dtype.items())
    return Packing(blocks, tuple(rest), tuple(logical.names))


def unpack(rb: pa.RecordBatch, packing: Packing, logical: pa.Schema) -> pa.RecordBatch:
    """The logical record batch of a packed one (copies the members out of their blocks).

    Args:
        rb: a stored (packed) record batch.
        packing: its file kind's plan.
        logical: the logical schema (column order and types).
    """
    n = rb.num_rows
    cols: dict[str, pa.Array] = {}
    for b in packing.blocks:
        arr = rb.column(b.name)
        block = arr.flatten().to_numpy(zero_copy_only=False).reshape(n, b.width)
        for m in b.members:
            vals = pa.array(np.ascontiguousarray(block[:, m.offset : m.offset + m.width]).reshape(-1))
            cols[m.name] = pa.FixedSizeListArray.from_arrays(vals, m.width) if m.is_list else vals
    for name in packing.rest:
        cols[name] = rb.column(name)
    return pa.RecordBatch.from_arrays([cols[f.name].cast(f.type) for f in logical], schema=logical)


UNPACKED_FORMAT_VERSION = 1
"""``format_version`` of a dataset stored one Arrow column per logical column (built with
``pack_columns = False``, or before packing existed); the reader still reads it."""

PACKED_FORMAT_VERSION = 2
"""``format_version`` of a dataset with packed blocks (a ``"packing"`` manifest entry)."""


def logical_schemas(data_schema: pa.Schema, layout: str) -> dict[str, pa.Schema]:
    """File kind (``main``, ``leftover``) -> its logical arrow schema, for ``layout`` (``meta``/``plain``)."""
    if layout == L.Layout.META.value:
        return {"main": L.meta_arrow_schema(data_schema), "leftover": L.plain_arrow_schema(data_schema)}
    return {"main": L.plain_arrow_schema(data_schema)}


def packing_plans(schema: Schema, data_schema: pa.Schema, layout: L.Layout | str) -> dict[str, Packing]:
    """The build's plans per file kind (``main``, and ``leftover`` for the meta layout)."""
    value = layout.value if isinstance(layout, L.Layout) else layout
    return {k: plan(s, role_order(schema)) for k, s in logical_schemas(data_schema, value).items()}


def packing_manifest(packs: dict[str, Packing]) -> dict[str, Any]:
    """Manifest keys: ``format_version`` and, when packed, ``packing`` (the plans per file kind)."""
    if not packs:
        return {"format_version": UNPACKED_FORMAT_VERSION}
    return {"format_version": PACKED_FORMAT_VERSION, "packing": {k: p.to_dict() for k, p in packs.items()}}
