"""Per-kind normalizers: one raw Arrow column of a batch -> its normalized column, or a
:class:`~common.errors.DataError` naming file, column and row. The rules are in :mod:`meta_io.source`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from meta_io.schema import LIST_KINDS, PAD_ID, ColumnKind, ColumnSpec, Schema
from meta_io.source.files import _EXPECTED, _is_text
from common.errors import DataError
from common.hashing import hash_strings


TOKEN_SEP = r"[\s,;|]+"


_INT_RE = r"^[0-9]+$"


_FLOAT_RE = r"^[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[nN]a[nN]|[iI]nf(inity)?)$"


_ISO_RE = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}([T ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]+)?)?)?(Z|[+-][0-9]{2}:?[0-9]{2})?$"


_TS_DIVISOR = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


@dataclass
class _FileState:
    path: Path
    csv: bool
    int_mode: dict[str, bool] = field(default_factory=dict)  # CSV id columns: integers or hashed
    truncated: dict[str, int] = field(default_factory=dict)
    null_ids: dict[str, int] = field(default_factory=dict)

    def where(self, col: ColumnSpec, row: int | None = None) -> str:
        at = f"{self.path}: column '{col.name}' ({col.kind.value})"
        return at if row is None else f"{at}: row {row}"


def _first_bad(mask: np.ndarray, first_row: int) -> tuple[int, str]:
    """(file row of the first True, ' (and N more in rows a-b)' suffix for this batch)."""
    idx = np.flatnonzero(mask)
    more = f" (and {idx.size - 1} more in rows {first_row}-{first_row + mask.size - 1})" if idx.size > 1 else ""
    return first_row + int(idx[0]), more


def _valid(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return arr.is_valid().to_numpy(zero_copy_only=False)


def _decode(arr: pa.Array) -> pa.Array:
    return arr.dictionary_decode() if pa.types.is_dictionary(arr.type) else arr


def _decoded_no_nulls(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int, problem: str) -> pa.Array:
    """``arr`` dictionary-decoded; a null is an error ``problem`` (with ``{more}`` for the batch's other rows)."""
    arr = _decode(arr)
    valid = _valid(arr)
    if not valid.all():
        row, more = _first_bad(~valid, first_row)
        raise DataError(f"{st.where(col, row)}: " + problem.format(more=more))
    return arr


def _text_matches(arr: pa.Array, pattern: str) -> np.ndarray:
    """True where a (non-null) string matches ``pattern``; nulls count as matching."""
    m = pc.match_substring_regex(arr, pattern)
    return m.fill_null(True).to_numpy(zero_copy_only=False)


def _parse_floats(arr: pa.Array, st: _FileState, col: ColumnSpec, rows_of: np.ndarray | None, first_row: int) -> pa.Array:
    """Strings -> float64, naming the first unparsable value's row."""
    arr = pc.utf8_trim_whitespace(arr)
    ok = _text_matches(arr, _FLOAT_RE)
    if not ok.all():
        bad = ~ok
        i = int(np.flatnonzero(bad)[0])
        row = first_row + (int(rows_of[i]) if rows_of is not None else i)
        raise DataError(f"{st.where(col, row)}: expected a number, got {arr[i].as_py()!r}")
    try:
        return pc.cast(arr, pa.float64())
    except pa.ArrowInvalid as exc:
        raise DataError(f"{st.where(col)}: rows {first_row}..: cannot parse numbers: {exc}") from None


def _ids_from_text(
    arr: pa.Array, st: _FileState, col: ColumnSpec, rows_of: np.ndarray | None, first_row: int, parsed: bool
) -> np.ndarray:
    """String ids -> int64: hashed, or integer-parsed.

    ``parsed``: the strings were cut out of text (a CSV cell, a token string),
    so decimal integers may be meant as integers; the first batch of the file
    decides. Typed Parquet strings are always hashed.
    """
    arr = _decode(arr)
    if not parsed or col.hash:
        return hash_strings(arr)
    arr = pc.utf8_trim_whitespace(arr)
    is_int = _text_matches(arr, _INT_RE)
    if col.name not in st.int_mode:
        if len(arr) == arr.null_count:  # nothing to decide on yet (all empty)
            return np.full(len(arr), PAD_ID, dtype=np.int64)
        # The first batch with values decides for the file: all decimal -> integer ids.
        st.int_mode[col.name] = bool(is_int.all())
    if not st.int_mode[col.name]:
        return hash_strings(arr)
    if not is_int.all():
        i = int(np.flatnonzero(~is_int)[0])
        row = first_row + (int(rows_of[i]) if rows_of is not None else i)
        raise DataError(
            f"{st.where(col, row)}: expected an integer id like the earlier rows of this file, got "
            f"{arr[i].as_py()!r}; set hash = true on this column to hash all its values"
        )
    try:
        out = pc.cast(arr, pa.int64())
    except pa.ArrowInvalid as exc:  # e.g. more than 19 digits
        raise DataError(f"{st.where(col)}: rows {first_row}..: integer id out of int64 range: {exc}") from None
    return out.fill_null(PAD_ID).to_numpy(zero_copy_only=False)


def _ids(
    arr: pa.Array, st: _FileState, col: ColumnSpec, rows_of: np.ndarray | None, first_row: int, parsed: bool
) -> np.ndarray:
    """Any accepted id array -> int64 numpy (nulls -> PAD_ID; negatives rejected)."""
    arr = _decode(arr)
    t = arr.type
    if _is_text(t):
        return _ids_from_text(arr, st, col, rows_of, first_row, parsed)
    if not pa.types.is_integer(t):
        raise DataError(f"{st.where(col)}: expected integer or string ids, got {t}")
    if col.hash:
        return hash_strings(pc.cast(arr, pa.string()))
    if pa.types.is_signed_integer(t):
        vals = pc.cast(arr, pa.int64())
        vals = (vals.fill_null(PAD_ID) if vals.null_count else vals).to_numpy(zero_copy_only=False)
        neg = (vals < 0) & _valid(arr)
        if neg.any():
            i = int(np.flatnonzero(neg)[0])
            row = first_row + (int(rows_of[i]) if rows_of is not None else i)
            raise DataError(
                f"{st.where(col, row)}: negative id {int(vals[i])} (ids must be >= 0; {PAD_ID} is padding)"
            )
        return vals
    u = arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.uint64)
    big = u > np.uint64(np.iinfo(np.int64).max)
    if big.any():
        i = int(np.flatnonzero(big)[0])
        row = first_row + (int(rows_of[i]) if rows_of is not None else i)
        raise DataError(f"{st.where(col, row)}: id {int(u[i])} does not fit in int64; set hash = true to hash it")
    vals = u.astype(np.int64)
    vals[~_valid(arr)] = PAD_ID
    return vals


def _sparse(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int, schema: Schema) -> pa.Array:
    valid = _valid(_decode(arr))
    if not valid.all():
        if col.name == schema.task_key:
            row, more = _first_bad(~valid, first_row)
            raise DataError(f"{st.where(col, row)}: null task key{more} (every row needs a task)")
        st.null_ids[col.name] = st.null_ids.get(col.name, 0) + int((~valid).sum())
    vals = _ids(arr, st, col, None, first_row, parsed=st.csv)  # nulls already PAD_ID on every path
    return pa.array(vals, pa.int64())


def _key(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int, schema: Schema) -> pa.Array:
    """A ``key`` column (grouping only, not a feature): int64 like a sparse id, but never null."""
    what = "null task key{more} (every row needs a task)" if col.name == schema.task_key else \
        "null key{more} (a 'key' column needs a value on every row)"
    arr = _decoded_no_nulls(arr, st, col, first_row, what)
    return pa.array(_ids(arr, st, col, None, first_row, parsed=st.csv), pa.int64())


def _split_tokens(arr: pa.Array) -> pa.Array:
    """'a b,c' -> ['a', 'b', 'c'] (empty tokens dropped later)."""
    return pc.split_pattern_regex(pc.utf8_trim_whitespace(_decode(arr)), TOKEN_SEP)


def _flatten(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(values of the non-null lists in order, length per row with null -> 0)."""
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    return arr.flatten(), lengths


def _drop_empty_tokens(values: pa.Array, lengths: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    if not (_is_text(values.type) and len(values)):
        return values, lengths
    keep = pc.not_equal(values, "").fill_null(True).to_numpy(zero_copy_only=False)
    if keep.all():
        return values, lengths
    row_of = np.repeat(np.arange(lengths.size), lengths)
    return values.filter(pa.array(keep)), np.bincount(row_of[keep], minlength=lengths.size)


def _pad(values: np.ndarray, lengths: np.ndarray, width: int, fill, dtype) -> tuple[np.ndarray, int]:
    """Pack ragged rows into [rows, width]: first ``width`` values kept, rest ``fill``.

    Layout (width 3)::

        values  [a b c d | e | f g]     lengths [4, 1, 2]
        out     [[a b c]                truncated rows: 1
                 [e . .]
                 [f g .]]
    """
    n = lengths.size
    out = np.full((n, width), fill, dtype=dtype)
    kept = np.minimum(lengths, width)
    truncated = int((lengths > width).sum())
    if truncated:  # drop each row's values past ``width`` (row-major order is kept)
        starts = np.cumsum(lengths) - lengths
        pos = np.arange(values.size) - np.repeat(starts, lengths)
        values = values[pos < width]
    out[np.arange(width)[None, :] < kept[:, None]] = values  # boolean fill is row-major
    return out, truncated


def _id_list(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> pa.Array:
    arr = _decode(arr)
    parsed = _is_text(arr.type)
    if parsed:
        arr = _split_tokens(arr)
    values, lengths = _flatten(arr)
    values, lengths = _drop_empty_tokens(_decode(values), lengths)
    row_of = np.repeat(np.arange(lengths.size), lengths)
    if values.null_count:
        row, more = _first_bad(np.bincount(row_of[~_valid(values)], minlength=lengths.size) > 0, first_row)
        raise DataError(f"{st.where(col, row)}: null element inside a list{more}")
    ids = _ids(values, st, col, row_of, first_row, parsed) if len(values) else np.zeros(0, np.int64)
    padded, truncated = _pad(ids, lengths, col.max_len, PAD_ID, np.int64)
    if truncated:
        st.truncated[col.name] = st.truncated.get(col.name, 0) + truncated
    return pa.FixedSizeListArray.from_arrays(pa.array(padded.reshape(-1), pa.int64()), col.max_len)


def _vector(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> pa.Array:
    arr = _decoded_no_nulls(arr, st, col, first_row, "null vector{more} (expected %d floats)" % col.dim)
    if _is_text(arr.type):
        arr = _split_tokens(arr)
    values, lengths = _flatten(arr)
    values, lengths = _drop_empty_tokens(values, lengths)
    wrong = lengths != col.dim
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        _, more = _first_bad(wrong, first_row)
        raise DataError(f"{st.where(col, first_row + i)}: expected {col.dim} values, got {int(lengths[i])}{more}")
    row_of = np.repeat(np.arange(lengths.size), lengths)
    if _is_text(values.type):
        values = _parse_floats(values, st, col, row_of, first_row)
    if values.null_count:
        row, _ = _first_bad(np.bincount(row_of[~_valid(values)], minlength=lengths.size) > 0, first_row)
        raise DataError(f"{st.where(col, row)}: null element inside the vector")
    flat = pc.cast(values, pa.float32()).to_numpy(zero_copy_only=False)
    bad = ~np.isfinite(flat)
    if bad.any():
        row = first_row + int(row_of[np.flatnonzero(bad)[0]])
        raise DataError(f"{st.where(col, row)}: NaN or infinite value in the vector")
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), col.dim)


def _floats(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> np.ndarray:
    """Any numeric (or CSV text) column -> float64 numpy; nulls are errors."""
    arr = _decoded_no_nulls(arr, st, col, first_row, "missing value (null){more}")
    if _is_text(arr.type):
        arr = _parse_floats(arr, st, col, None, first_row)
    return pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)


# Scalar float kinds: (mask of bad values, what a good value is). One rule per kind.
_SCALAR_RULES: dict[ColumnKind, tuple[Callable[[np.ndarray], np.ndarray], str]] = {
    ColumnKind.DENSE: (lambda x: ~np.isfinite(x), "a finite number"),
    ColumnKind.LABEL: (lambda x: (x != 0) & (x != 1), "a 0/1 label"),  # NaN compares unequal to both
    ColumnKind.ORACLE: (lambda x: ~((x >= 0) & (x <= 1)), "a probability in [0, 1]"),
}


def _scalar(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> pa.Array:
    """A dense, label or oracle column -> float32, naming the first value its rule rejects."""
    is_bad, expected = _SCALAR_RULES[col.kind]
    x = _floats(arr, st, col, first_row)
    bad = is_bad(x)
    if bad.any():
        row, more = _first_bad(bad, first_row)
        raise DataError(f"{st.where(col, row)}: expected {expected}, got {x[row - first_row]}{more}")
    return pa.array(x.astype(np.float32), pa.float32())


def _timestamp(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> pa.Array:
    arr = _decoded_no_nulls(arr, st, col, first_row, "missing time (null){more}")
    t = arr.type
    if _is_text(t):
        arr = pc.utf8_trim_whitespace(arr)
        is_int = _text_matches(arr, r"^-?[0-9]+$")
        is_iso = _text_matches(arr, _ISO_RE)
        # One form per batch: all int seconds or all ISO times; name the first odd row.
        bad = ~(is_int if is_int[0] else is_iso)
        if bad.any():
            row, more = _first_bad(bad, first_row)
            form = "int seconds like row %d" % first_row if is_int[0] else "an ISO-8601 time like row %d" % first_row
            raise DataError(
                f"{st.where(col, row)}: expected {form}, got {arr[row - first_row].as_py()!r}{more}"
            )
        if is_int[0]:
            return pc.cast(arr, pa.int64())
        naive = pc.replace_substring_regex(arr, r"Z$", "")
        try:
            arr = pc.cast(naive, pa.timestamp("ns"))
        except pa.ArrowInvalid:
            try:
                arr = pc.cast(arr, pa.timestamp("ns", tz="UTC"))
            except pa.ArrowInvalid as exc:
                raise DataError(
                    f"{st.where(col)}: rows {first_row}..: mixed or unsupported time zones: {exc}"
                ) from None
        t = arr.type
    if pa.types.is_integer(t):
        return pc.cast(arr, pa.int64())
    if pa.types.is_timestamp(t):
        vals = pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False) // _TS_DIVISOR[t.unit]  # floor: before-1970 stays right
        return pa.array(vals, pa.int64())
    if pa.types.is_date32(t):
        return pa.array(pc.cast(arr, pa.int32()).to_numpy(zero_copy_only=False).astype(np.int64) * 86_400, pa.int64())
    if pa.types.is_date64(t):
        return pa.array(pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False) // 1000, pa.int64())
    raise DataError(f"{st.where(col)}: expected {_EXPECTED[col.kind]}, got {t}")


def _extra(arr: pa.Array, st: _FileState, col: ColumnSpec) -> pa.Array:
    arr = _decode(arr)
    if pa.types.is_string(arr.type):
        return arr
    try:
        return pc.cast(arr, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(f"{st.where(col)}: cannot carry {arr.type} as text: {exc}") from None


def _normalize(table: pa.Table, st: _FileState, schema: Schema, out_schema: pa.Schema, first_row: int) -> pa.Table:
    arrays = []
    for col in schema.columns:
        chunked = table.column(col.name)
        arr = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
        k = col.kind
        if k == ColumnKind.SPARSE:
            out = _sparse(arr, st, col, first_row, schema)
        elif k == ColumnKind.KEY:
            out = _key(arr, st, col, first_row, schema)
        elif k in LIST_KINDS:
            out = _id_list(arr, st, col, first_row)
        elif k == ColumnKind.VECTOR:
            out = _vector(arr, st, col, first_row)
        elif k in _SCALAR_RULES:
            out = _scalar(arr, st, col, first_row)
        elif k == ColumnKind.TIMESTAMP:
            out = _timestamp(arr, st, col, first_row)
        else:
            out = _extra(arr, st, col)
        arrays.append(out)
    return pa.Table.from_arrays(arrays, schema=out_schema)
